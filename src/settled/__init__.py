"""settled: completion is a proof, not a status."""
