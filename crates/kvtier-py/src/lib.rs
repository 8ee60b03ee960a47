//! Python bindings (PyO3, abi3): a thin layer over the kvtier leader and worker.
