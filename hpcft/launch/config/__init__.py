"""The run's configuration: the options model, machine profiles, site settings, memory plan."""
