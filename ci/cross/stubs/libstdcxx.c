/* Link-time stand-in for the target machine's libstdc++.so.6 (cross builds only, never shipped).
 * The libraries link only these C++ ABI symbols (function-local statics, exception cleanup), as
 * the native x86_64 build shows (readelf --dyn-syms on its libraries); linking this stub
 * gives the same NEEDED entry and symbol versions, and the real library resolves them at load. */
void __cxa_guard_acquire(void) {}
void __cxa_guard_release(void) {}
void __cxa_guard_abort(void) {}
void __gxx_personality_v0(void) {}
