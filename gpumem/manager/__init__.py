"""MemoryManager (one device) and its parts: the miss path and OOM ladder (miss_path), streams
(stream_book), expandable segments, batches and warm-up, CPU fallback, pressure, measure().

The parts take what they need from the manager through its declared attributes; none imports
:mod:`gpumem.manager.memory_manager` except for type checking. Public names are re-exported by
:mod:`gpumem` itself.
"""
