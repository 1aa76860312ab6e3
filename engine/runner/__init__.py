"""One packed forward pass on the device: the model runner, step buffers, CUDA graphs, copy fences, swap copies, step isolation, memory planning, device and model set-up."""
