"""hierarchy.l2."""
