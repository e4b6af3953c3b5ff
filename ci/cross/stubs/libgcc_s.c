/* Link-time stand-in for the target machine's libgcc_s.so.1 (cross builds only, never shipped). */
void _Unwind_Resume(void) {}
