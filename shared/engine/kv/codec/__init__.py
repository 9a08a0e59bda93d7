"""The codec store: full blocks as a KV codec's bytes, partial last blocks whole in tails."""
