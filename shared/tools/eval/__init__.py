"""The offline quality harnesses behind `tsukimi eval kv` and `tsukimi eval fastgen`: a text split into calibration and
evaluation spans, a codec or FastGen policy served over the model, and the agreement with the uncompressed model.
"""
