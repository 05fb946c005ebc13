"""The model's Triton kernels other than attention: RMSNorm (with the residual add), rotary
embeddings, MoE routing and grouped GEMMs, and the FP8 GEMMs with their launch tables. The
layers in `models/layers` call them on a GPU with the triton backend."""
