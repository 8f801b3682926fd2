"""Pure decisions over plain data: what to do after a failure, when to grow, who straggles."""
