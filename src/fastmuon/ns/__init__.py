"""Newton–Schulz orthogonalisation: the kernels, the batching planner, the engine that runs a plan, device facts."""
