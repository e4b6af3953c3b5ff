"""What a user process needs at run time: device and provider lookup, library loading, dispatch. Never imports the build."""
