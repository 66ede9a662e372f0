"""modelopt-ext sparse attention."""
