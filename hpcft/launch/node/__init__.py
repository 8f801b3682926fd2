"""What runs on each node: the task wrapper, the warm standby, staging and the janitors."""
