"""Where routed-expert math runs: ``cocompute`` (on the CPU, in place); ``offload`` comes later."""

PARADIGMS = ("cocompute",)
