"""Models bundled for the main job and the benchmarks."""
