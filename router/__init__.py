"""Input-guided routing: sentence encoder and nearest-centroid mask lookup."""
