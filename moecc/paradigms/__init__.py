"""Where routed-expert math runs: ``cocompute`` (on the CPU, in place) or ``offload`` (on the device, after
copying the weights there)."""

PARADIGMS = ("cocompute", "offload")
