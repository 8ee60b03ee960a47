//! kvtier-engine: the reference engine (a small Llama decoder on CPU driving kvtier like TensorRT-LLM).
