"""Reports about a wrapped model: unit summary, memory stats, activation bytes."""
