"""Reference Gym servers, one per kind, as `GymServer` factories for `ParticipantHost`."""
