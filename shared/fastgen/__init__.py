"""FastGen (Ge et al. 2024, "Model Tells You What to Discard"): adaptive per-KV-head eviction chosen by profiling the
prompt's attention, as the engine serves it: the policies and their rules, the profile, the lanes that hold each head's
kept KV (raw or kvquant-coded), and a profile's hand-off from prefill to decode. The quality harness behind
`tsukimi eval fastgen` is `shared.tools.eval.fastgen`.
"""
