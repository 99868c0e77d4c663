"""`edgeroute calibrate`: labels on the quantized bundle, trained routers, thresholds with a
bound, task-level checks, and the calibration section that becomes the runtime's default.
Torch is allowed here (training only); what it produces runs torch-free in the runtime."""
