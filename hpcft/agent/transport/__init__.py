"""How the agents talk: authenticated TCP or MPI links, the mesh, rendezvous, heartbeats."""
