"""Analyses over the metrics store: koordlet's peak prediction (``prediction``)."""
