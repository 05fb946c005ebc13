"""Device memory below every other package: the KV pool (`kv_pool.py`), the pages the attention
backends read and write and the transfer agents send, described by a `KVLayout`."""
