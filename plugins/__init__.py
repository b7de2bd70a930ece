"""Custom ops for DFlash: the KV-injection kernel and its PyTorch / TensorRT registrations."""
