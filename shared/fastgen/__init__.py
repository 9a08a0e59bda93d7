"""FastGen (Ge et al. 2024, "Model Tells You What to Discard"): adaptive per-KV-head eviction chosen by profiling the
prompt's attention, and the quality harness behind `tsukimi eval fastgen`. The engine and serving paths do not use it
yet.
"""
