"""A step's vocabulary, below `runtime` and `spec` (both build on it): the messages from the
front to the ranks and back (`plan.py`), what a rank keeps of its requests (`rank_state.py`),
the sequences of a pass and their batch (`batch.py`), sampling (`sampler.py`) and structured
output's masks (`grammar.py`)."""
