/*
** signames.c -- signal numbers <-> the names Python's signal.Signals uses.
*/
#include <signal.h>
#include <string.h>

#include "mp.h"

static const struct { int num; const char *name; } signames[] = {
  {SIGHUP, "SIGHUP"}, {SIGINT, "SIGINT"}, {SIGQUIT, "SIGQUIT"},
  {SIGILL, "SIGILL"}, {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"},
  {SIGBUS, "SIGBUS"}, {SIGFPE, "SIGFPE"}, {SIGKILL, "SIGKILL"},
  {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
  {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"},
  {SIGSTKFLT, "SIGSTKFLT"}, {SIGCHLD, "SIGCHLD"}, {SIGCONT, "SIGCONT"},
  {SIGSTOP, "SIGSTOP"}, {SIGTSTP, "SIGTSTP"}, {SIGTTIN, "SIGTTIN"},
  {SIGTTOU, "SIGTTOU"}, {SIGURG, "SIGURG"}, {SIGXCPU, "SIGXCPU"},
  {SIGXFSZ, "SIGXFSZ"}, {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"},
  {SIGWINCH, "SIGWINCH"}, {SIGIO, "SIGIO"}, {SIGPWR, "SIGPWR"},
  {SIGSYS, "SIGSYS"},
};

#define NSIGNAMES (sizeof(signames) / sizeof(signames[0]))

const char *mp_signal_name(int signum) {
  size_t i;
  for (i = 0; i < NSIGNAMES; i++)
    if (signames[i].num == signum) return signames[i].name;
  return NULL;
}

int mp_signal_number(const char *name) {
  size_t i;
  for (i = 0; i < NSIGNAMES; i++)
    if (strcmp(signames[i].name, name) == 0) return signames[i].num;
  return 0;
}

/* core.signals: name -> number, for scripts that signal their workers. */
void mp_open_signames(lua_State *L) {
  size_t i;
  lua_createtable(L, 0, (int)NSIGNAMES);                /* M signals */
  for (i = 0; i < NSIGNAMES; i++) {
    lua_pushinteger(L, signames[i].num);                /* M signals num */
    lua_setfield(L, -2, signames[i].name);              /* M signals */
  }
  lua_setfield(L, -2, "signals");                       /* M */
}
