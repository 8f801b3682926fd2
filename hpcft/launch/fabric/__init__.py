"""The nodes' reports to the supervisor over the network and the live view built from them."""
