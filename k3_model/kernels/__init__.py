"""Latency-specialized K3 kernels, one package per op (``k3_model/kernels/<op>/``).

Each package defines ``SCOPE`` (a :class:`k3_model.dispatch.OpScope`, equal to what it was tested on)
and the op's entry point with the standard path's signature. A missing package means no kernel is
merged for that op and the dispatcher uses the standard path (and says so in the trace).
"""
