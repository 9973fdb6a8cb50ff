-- bench/json.lua -- a small JSON decoder for the one-line outputs of the
-- floors and the Python peers: objects, arrays, strings, numbers, true,
-- false, null (-> nil).  decode(s) returns the value, or nil and an error.
-- encode(v) writes the same subset back (build/bench/last.json, the
-- baseline): tables with keys 1..n are arrays, others objects with their
-- keys sorted, so that a file changes only where a value does.
local M = {}

local escapes = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }

function M.decode(s)
  local pos = 1
  local function ws() pos = s:find("[^ \t\r\n]", pos) or #s + 1 end
  local function err(m) error({ json = m .. " at " .. pos }) end
  local value
  local function str()
    pos = pos + 1
    local out = {}
    while true do
      local c = s:sub(pos, pos)
      if c == "" then err("unterminated string")
      elseif c == '"' then pos = pos + 1; break
      elseif c == "\\" then
        local e = s:sub(pos + 1, pos + 1)
        if e == "u" then
          local cp = tonumber(s:sub(pos + 2, pos + 5), 16) or err("bad \\u")
          out[#out + 1] = utf8.char(cp); pos = pos + 6
        else
          out[#out + 1] = escapes[e] or e; pos = pos + 2
        end
      else
        local j = s:find('["\\]', pos) or #s + 1
        out[#out + 1] = s:sub(pos, j - 1); pos = j
      end
    end
    return table.concat(out)
  end
  function value()
    ws()
    local c = s:sub(pos, pos)
    if c == "{" then
      local t = {}
      pos = pos + 1; ws()
      if s:sub(pos, pos) == "}" then pos = pos + 1; return t end
      while true do
        ws()
        if s:sub(pos, pos) ~= '"' then err("expected key") end
        local k = str()
        ws()
        if s:sub(pos, pos) ~= ":" then err("expected ':'") end
        pos = pos + 1
        t[k] = value()
        ws()
        c = s:sub(pos, pos); pos = pos + 1
        if c == "}" then return t elseif c ~= "," then err("expected ',' or '}'") end
      end
    elseif c == "[" then
      local t, n = {}, 0
      pos = pos + 1; ws()
      if s:sub(pos, pos) == "]" then pos = pos + 1; return t end
      while true do
        n = n + 1
        t[n] = value()
        ws()
        c = s:sub(pos, pos); pos = pos + 1
        if c == "]" then return t elseif c ~= "," then err("expected ',' or ']'") end
      end
    elseif c == '"' then return str()
    elseif s:sub(pos, pos + 3) == "true" then pos = pos + 4; return true
    elseif s:sub(pos, pos + 4) == "false" then pos = pos + 5; return false
    elseif s:sub(pos, pos + 3) == "null" then pos = pos + 4; return nil
    else
      local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
      if not num or num == "" then err("unexpected '" .. c .. "'") end
      pos = pos + #num
      return tonumber(num) or err("bad number")
    end
  end
  local ok, v = pcall(function()
    local x = value()
    ws()
    if pos <= #s then err("trailing text") end
    return x
  end)
  if ok then return v end
  return nil, type(v) == "table" and v.json or tostring(v)
end

local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function encode(v, indent, out)
  local t = type(v)
  if t == "table" then
    local inner = indent .. "  "
    if #v > 0 or next(v) == nil then
      out[#out + 1] = "["
      for i, x in ipairs(v) do
        out[#out + 1] = (i > 1 and "," or "") .. "\n" .. inner
        encode(x, inner, out)
      end
      out[#out + 1] = (#v > 0 and "\n" .. indent or "") .. "]"
    else
      local keys = {}
      for k in pairs(v) do keys[#keys + 1] = tostring(k) end
      table.sort(keys)
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        out[#out + 1] = (i > 1 and "," or "") .. "\n" .. inner .. quote(k) .. ": "
        encode(v[k], inner, out)
      end
      out[#out + 1] = "\n" .. indent .. "}"
    end
  elseif t == "string" then out[#out + 1] = quote(v)
  elseif t == "number" then
    if math.type(v) == "integer" then out[#out + 1] = tostring(v)
    elseif v ~= v or v == math.huge or v == -math.huge then out[#out + 1] = "null"
    else out[#out + 1] = string.format("%.6g", v) end
  elseif t == "boolean" then out[#out + 1] = tostring(v)
  else out[#out + 1] = "null" end
end

function M.encode(v)
  local out = {}
  encode(v, "", out)
  return table.concat(out) .. "\n"
end

return M
