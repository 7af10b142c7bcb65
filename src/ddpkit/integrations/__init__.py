"""Optional integrations with the tools users bring: Lightning (:mod:`ddpkit.integrations.lightning`) and
TensorBoard (:mod:`ddpkit.integrations.tensorboard`). Each needs its extra installed; importing this package
imports neither."""
