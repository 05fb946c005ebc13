"""Building blocks shared by the model families: norms, rotary embedding, linears, MLP and MoE."""
