"""Seeing memory: allocation tracking, history recording, traces (recorded or synthetic) and
their replay, snapshots, plots, summaries and the PyTorch bridges (snapshot import, memory_viz
export)."""
