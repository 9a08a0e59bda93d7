"""FastGen in the engine: the KV of sequences FastGen holds, in lanes cut from the pool's blocks (`lanes`,
`lane_store`: raw or kvquant-coded entries), appended, attended and evicted per KV head (`sparse_kv`), the step's
attention split between lanes and the paged pool (`attention`), and `FastGenKv` (`kv`), which profiles prompts and
moves their kept KV into lanes. The algorithm it follows (policies, what each keeps, the profile) is `shared.fastgen`.
"""
