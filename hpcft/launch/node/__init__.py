"""What runs on each node: the task wrapper, the warm standby, the environment's broadcast and the janitors."""
