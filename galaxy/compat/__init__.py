"""Reading what users bring from other tools (Galaxy-LM's config files); no torch here."""
