"""What every Orchard service shares."""
