"""Scheduling: requests and their sampling parameters, the page-table KV manager, continuous batching."""
