"""The time-series store (SQLite): writes, chunks, rollups, reads."""
