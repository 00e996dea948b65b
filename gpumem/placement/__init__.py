"""Where memory comes from when there is more than one manager: the shared managers per device
(shared), cross-manager release (peers), several devices at once (multi) and device selection."""
