"""The Spark layer: adapts Spark's Python Data Source API calls to the replog core."""
