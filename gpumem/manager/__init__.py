"""MemoryManager (one device) and its parts: segment growth (growth), the miss path and OOM
ladder (miss_path), streams (stream_book), expandable segments, batches and warm-up, CPU
fallback, pressure, measure().

The manager is composed of the parts, not mixed from them: each owns its state, reaches the
Cython core through a CoreAccess (which holds the manager weakly) and the others through their
declared methods (batches and expandable segments through growth.Growth); none imports
:mod:`gpumem.manager.memory_manager`, even for type checking: what a part needs of the manager
is a Protocol of :mod:`gpumem.manager.interfaces` (tests/test_layout.py checks it; see
docs/architecture.md). Public names are re-exported by :mod:`gpumem` itself.
"""
