"""Own models: a folder a user brings (timm, Hugging Face, torchvision, TorchScript,
``torch.export`` or ONNX), described by its manifest, checked in a child process before
anything of it is loaded here, then served like the built-in models."""
