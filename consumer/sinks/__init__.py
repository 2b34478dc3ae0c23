"""Sinks: where each consumer delivers its batches. A sink knows nothing about offsets."""
