"""Speculative decoding: the MTP and EAGLE-3 drafts, draft trees and their verification, and
the strategies (two-pass, naive) with a front half and a rank half (`spec/strategy.py`)."""
