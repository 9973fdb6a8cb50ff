/*
** codec.h -- Lua values <-> bytes.
**
** The same codec carries a spawned worker's function and arguments, every
** result and structured error value, and every message on queues and pipes.
** Encoding never loses a value silently: what cannot be sent raises a Lua
** error naming the value and the path to it.  Decoding treats its input as
** untrusted unless the caller allows functions, which only a worker's own
** parent may do over a private channel.
*/
#ifndef mp_codec_h
#define mp_codec_h

#include <stddef.h>
#include "lua.h"

/* flags for mp_encode / mp_decode */
#define MP_CODEC_DATA       0  /* data only: functions only by module reference */
#define MP_CODEC_FUNCTIONS  1  /* Lua functions as bytecode with their upvalues */
/* One encoding decoded by many receivers that never give anything back (the
** payload of fresh workers).  A reference that a type takes for its receiver
** (a file_system name) is taken once and held by the box (mp_write_hold)
** until the sender closes it; a decoded object takes no reference of its
** own.  Give the flag to both mp_encode and mp_decode. */
#define MP_CODEC_BROADCAST  2
/* mp_encode, for error values only: a value that cannot cross (a function
** in DATA mode, a userdata of no codec type, a thread) goes as a short
** description, the string "<function>", "<userdata>" or "<thread>", and a
** metatable that cannot is left out, so that every other part arrives. */
#define MP_CODEC_DESCRIBE   4
/* mp_decode, for a message nobody will receive (the results of a context
** that failed): decodes only to give back what it holds.  Module
** references are not resolved (nil), and every object decoded is closed
** (its __close) at once: a file_system name's reference is released, a
** descriptor closed. */
#define MP_CODEC_DISCARD    8

/* The encoded form of one value: bytes plus the descriptors that must
** travel beside them (shared memory, sockets).  The descriptors are borrowed
** from the objects that own them, which the box keeps alive. */
typedef struct mp_Encoded {
  const char *data;
  size_t size;
  const int *fds;
  size_t nfds;
} mp_Encoded;

/* Encodes the 'n' values at stack indices first..first+n-1 as one message
** (references shared between them stay shared) and pushes the box that owns
** the encoding (a userdata; the encoding stays valid while the box lives).
** names[i] names value i in error messages ("args", "worker", "result";
** names == NULL: "value1", "value2", ...); 'to' ends them, e.g. "to a
** spawned process: pass it differently or use start_method \"fork\"".
** Nothing but the box is pushed.  Raises a Lua error for anything that
** cannot be sent, e.g.
**   cannot send upvalue 'sock' of function 'worker' (userdata) to a ...
**   cannot send args[2].conn (userdata) to a ... */
void mp_encode(lua_State *L, int first, int n, int flags,
               const char *const names[], const char *to, mp_Encoded *out);

/* A buffer an encoding starts in, so that a sender of many messages grows
** no buffer and touches no fresh page a message (a channel keeps one for
** its puts, as it keeps one for what it reads). */
typedef struct mp_Spare {
  char *data;
  size_t cap;
} mp_Spare;

/* mp_encode, starting in 'spare''s buffer, which the box owns from then on
** ('spare' is left empty; NULL: a fresh buffer). */
void mp_encode_spare(lua_State *L, int first, int n, int flags,
                     const char *const names[], const char *to,
                     mp_Spare *spare, mp_Encoded *out);

/* Gives the buffer of the box at stack index 'box' to an empty 'spare'
** when it is at most 'keep' bytes; the box's encoding is gone then (its
** 'data' may be reused), what else it holds stays. */
void mp_encoded_spare(lua_State *L, int box, mp_Spare *spare, size_t keep);

/* Decodes 'size' bytes, pushes the values and returns how many, or raises a
** Lua error that says what is wrong with the input.  'fds' are the
** descriptors that came with the bytes: a decoded object that keeps one sets
** its slot to -1; the caller closes whatever is left. */
int mp_decode(lua_State *L, const char *data, size_t size, int flags,
              int *fds, size_t nfds);

/* mp_decode, but the message's first table (its first value, when that is
** a table without a metatable) is decoded into the table at stack index
** 'into' instead of a new one, and that table is what is pushed: a
** receiver that takes many big messages of the same shape reuses one
** table rather than making and collecting one a message.  Its items 1..n
** (nil ones too) and the message's fields are written over what 'into'
** held; what it held past n, and fields the message lacks, stay. */
int mp_decode_into(lua_State *L, int into, const char *data, size_t size,
                   int flags, int *fds, size_t nfds);

/* mp_decode_into ('into' may be 0: the first table is a new one), but once
** the first 'after' array items of the message's first table (when it has
** no metatable) are in it, where(L, t, ud, count, &shift) is called with
** that table at stack index t and the count of its later items, and may
** push another table (and return 1): the later items go there, item i
** into index i + shift, as they are read; or push nothing (and return 0):
** they go into t.  A receiver that moves the items of each message into
** one big table (the Pool's results) is spared the move, and the emptying
** of t after it. */
typedef struct mp_Spill {
  int after;
  int (*where)(lua_State *L, int t, void *ud, lua_Integer count,
               lua_Integer *shift);
  void *ud;
} mp_Spill;
int mp_decode_spill(lua_State *L, int into, const mp_Spill *spill,
                    const char *data, size_t size, int flags, int *fds,
                    size_t nfds);

/* Frees the encoding of the box at 'box' now (not at its collection) and
** closes (__close) the objects held with mp_write_hold.  Idempotent. */
void mp_encoded_close(lua_State *L, int box);

/* --- extension: userdata types that know how to cross a process boundary.
** A type registers a mp_CodecType for its metatable name; the encoder calls
** 'encode' with the userdata at 'idx' and a writer, the decoder calls
** 'decode' with a reader and must push exactly one value.
** The registration is per lua_State and keeps the pointer: the type must
** outlive the state (a static const).  The encoder only trusts a userdata
** whose metatable is the registry's 'tname' (luaL_newmetatable).  'decode'
** sees exactly the bytes and descriptors 'encode' wrote: reading past them
** raises, leaving some unread is an error too.  Pointers from mp_read_bytes
** are valid until mp_decode returns. */
typedef struct mp_Writer mp_Writer;
typedef struct mp_Reader mp_Reader;

typedef struct mp_CodecType {
  const char *tname;   /* metatable name, as given to luaL_newmetatable */
  void (*encode)(lua_State *L, int idx, mp_Writer *w);
  void (*decode)(lua_State *L, mp_Reader *r);
} mp_CodecType;

void mp_codec_register(lua_State *L, const mp_CodecType *type);

void mp_write_bytes(lua_State *L, mp_Writer *w, const void *p, size_t n);
void mp_write_fd(lua_State *L, mp_Writer *w, int fd);     /* borrowed */
/* Pops the value at the top: an object that holds a reference on behalf of
** the encoding; the box keeps it and mp_encoded_close closes it. */
void mp_write_hold(lua_State *L, mp_Writer *w);
int mp_write_flags(const mp_Writer *w);   /* mp_encode's flags */
const char *mp_read_bytes(lua_State *L, mp_Reader *r, size_t n);
int mp_read_fd(lua_State *L, mp_Reader *r);  /* takes ownership; raises if none */
int mp_read_flags(const mp_Reader *r);    /* mp_decode's flags */

#endif
