"""Run-directory storage: whole-file writes that a crash cannot tear, and URIs without their credentials."""
