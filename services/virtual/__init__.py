"""The whole cluster in one process on a virtual clock: the real service classes (scheduler, prefill, decode,
cache-store, and the gateway's request sessions) over the real `Bus`, whose NATS client is an in-process one that
delivers each message when a modelled network would; an event loop whose clock jumps to the next event; the sim
engine's steps taking their modelled time without sleeping. What differs from production, and why, is said in each
module and in `docs/experiments/virtual-clock.md`.
"""
