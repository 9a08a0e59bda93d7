"""Offline KVQuant calibration (`tsukimi calibrate kv`): Fisher-weighted codebooks and key grids from a text, written
as the file the engine reads (`shared.kvcompress.calibration`).
"""
