"""`sparkwatch launch`'s decisions: will it fit, the environment, learned peaks, boot phases, settling."""
