"""K3 ops: each has a standard-path implementation and goes through :mod:`k3_model.dispatch`."""
