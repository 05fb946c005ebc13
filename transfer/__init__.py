"""KV transfer between prefill and decode instances: layout descriptors, rank mapping, bootstrap, UCX."""
