"""Usage rollups, prices, monthly statements and reports: money in integer micro-units, never floats."""
